"""``pretrain-study``: runs a study YAML (runs x seeds x evaluations, resumable) and tabulates its results."""
