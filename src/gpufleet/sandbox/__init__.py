"""A local simulated GPU fleet: nspawn hosts with sshd, sudo, apt and dockerd, local mirrors and registry, and GPU
stand-ins; used by `gpufleet sandbox` and tests/integration. See docs/test-hosts.md.

    fleet = Fleet(test_config())
    fleet.start()
    a, b = fleet.add_hosts([H200x3, NO_GPU])
    fleet.stop()                                    # leaves no process, mount, netns, link
"""
