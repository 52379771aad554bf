"""``kvbucket demo``: the real-model prefix-reuse demo (default) and the synthetic one."""
