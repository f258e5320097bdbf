"""The site cache: a pull-through image registry and a model hub mirror, one download per site (docs/site-cache.md)."""
