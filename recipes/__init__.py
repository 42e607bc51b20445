"""draftsmith recipes: YAML files shipped with the package (see README)."""
