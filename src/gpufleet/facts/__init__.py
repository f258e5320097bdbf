"""pyinfra facts for gpufleet: pure, typed parsers of what a host reports (nvidia-smi, Docker, our own files).

Each fact's process() only parses; tests feed it output recorded on real hosts (tests/fixtures/nvidia-smi/).
"""
