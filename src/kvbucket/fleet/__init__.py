"""Many nodes, one bucket prefix: shared capacity, eviction and visibility (docs/fleet.md).

The object store is the coordination medium: each node writes small journal objects under
``<prefix>/_fleet/`` and folds in the others'; no server of kvbucket's own runs anywhere.
Modules: :mod:`.config` (the ``fleet`` spec field), :mod:`.layout` (object names, encodings,
the listing), :mod:`.wire` (what is read back, bounded and checked: it is untrusted),
:mod:`.quarantine` (objects that did not parse), :mod:`.view` (the folded picture and the
eviction choice), :mod:`.sync` (one node's thread) with its parts :mod:`.state`, :mod:`.reader`,
:mod:`.compactor` and :mod:`.peers` (liveness on the node's own clock, disagreements warned),
:mod:`.host` and :mod:`.member` (how tiers plug in), :mod:`.report` (``kvbucket du``).
"""

from kvbucket.fleet.config import FleetConfig
from kvbucket.fleet.layout import FLEET_DIR, is_fleet_name

__all__ = ["FLEET_DIR", "FleetConfig", "is_fleet_name"]
