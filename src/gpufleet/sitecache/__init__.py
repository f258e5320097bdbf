"""The site cache slice: Debian's docker-registry as a pull-through cache on the inventory group `site_cache`'s host
(facts, operations, deploy), so a site downloads each image once (docs/site-cache.md)."""
