"""Planning, as pure functions of measured facts: the ``Profile`` (what was measured), the cost
models (eq. 3-10 of the paper: step time and peak memory of a plan) and the search for the
fastest plan that fits. Nothing here touches a model or installs a hook."""
