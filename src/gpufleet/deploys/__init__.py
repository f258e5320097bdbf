"""@deploy functions composing gpufleet's operations (the files under deploys/ at the repo root only call these)."""
