"""Many nodes, one bucket prefix: shared capacity, eviction and visibility (docs/fleet.md).

The object store is the coordination medium: each node writes small journal objects under
``<prefix>/_fleet/`` and folds in the others'; no server of kvbucket's own runs anywhere.
Modules: :mod:`.config` (the ``fleet`` spec field), :mod:`.layout` (object names and
encodings), :mod:`.view` (the folded picture and the eviction choice), :mod:`.sync` (one
node's thread), :mod:`.host` (how the L2 adapter plugs in).
"""

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import FLEET_DIR, is_fleet_name

__all__ = ["FLEET_DIR", "FleetConfig", "is_fleet_name"]
