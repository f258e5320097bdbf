"""A local simulated GPU fleet: nspawn hosts with sshd/sudo/apt/dockerd, a Debian mirror, stand-ins of NVIDIA's and
Docker's apt repos, a registry with stand-in vLLM images, and GPU stand-ins. Used by `gpufleet sandbox` and tests/integration.

    from gpufleet.sandbox.config import H200x3, NO_GPU, sandbox_config, test_config
    from gpufleet.sandbox.fleet import Fleet

    fleet = Fleet(test_config())
    fleet.start()                                   # caches: base rootfs, mirror, repo, images
    a, b = fleet.add_hosts([H200x3, NO_GPU])        # parallel boot; Host(name, index, ip, netns, dir, gpus)
    fleet.ssh(a, "sudo nvidia-smi -L"); fleet.run_in(b, "ip route"); fleet.read_file(a, "/etc/hostname")
    fleet.reboot(a); fleet.set_connected(b, False); fleet.write_inventory()
    fleet.stop()                                    # leaves no process, mount, netns, link

Modules: config (names, subnets, GPU profiles), rootfs (debootstrap base + mirror debs), nvidia_repo, docker_repo,
apt_signing (their throwaway keys), cache (build-then-rename cache entries), image, registry (tags moved as nightlies
move), router_index (the wheels' package indexes), hub (the stand-in Hugging Face hub), services (mirror + registry),
network, hosts, state, procs, fleet, inventory, nvidia_smi, kernel_log, gpu_faults; standin/ holds the stdlib-only
programs that run inside hosts and images. See docs/test-hosts.md.
"""
