"""The site cache slice: Debian's docker-registry as a pull-through cache on the inventory group `site_cache`'s host
(facts, operations, deploy), so a site downloads each image once, and olah as its mirror of the model hub (mirror)
(docs/site-cache.md)."""
