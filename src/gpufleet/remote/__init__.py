"""Reaching hosts: SSH through pyinfra's connector, and HTTP to a host's loopback over it.

gevent must patch before any thread or pyinfra State exists, so the first import of this package does it.
"""

from gevent import monkey

if not monkey.is_module_patched("socket"):
    monkey.patch_all()
