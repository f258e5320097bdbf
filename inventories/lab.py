"""Example fleet: multi-GPU boxes in a homelab / small lab.

Run the main job:   pyinfra inventories/lab.py deploys/qwen35.py
See what it runs:   gpufleet render inventories/lab.py --host gpu-box-1

Fleet-wide settings live in group_data/all.py; per-host settings below win over them. Every setting, its
default and its meaning: README.md ("Settings") and src/gpufleet/defaults.py.
"""

gpu_boxes = [
    # The write-up's box: 3 GPUs, pipeline parallel 3, port 5000 (all profile defaults).
    ("gpu-box-1", {"ssh_hostname": "192.168.1.50", "vllm_gpus": [0, 1, 2], "vllm_port": 5000}),
    # A 2-GPU box: pipeline parallel must match the GPU count.
    ("gpu-box-2", {
        "ssh_hostname": "192.168.1.51",
        "vllm_gpus": [0, 1],
        "vllm_args": {"pipeline-parallel-size": 2},
    }),
    # An 8-GPU box serving on 4 of them, leaving the rest for other work. Tensor x pipeline = 2 x 2: pipeline
    # parallel 4 or more with Qwen 3.5 has upstream failures (`gpufleet lint` says so).
    ("gpu-box-3", {
        "ssh_hostname": "192.168.1.52",
        "vllm_gpus": [4, 5, 6, 7],
        "vllm_args": {"tensor-parallel-size": 2, "pipeline-parallel-size": 2},
    }),
]

# One endpoint for every agent: vllm-router on a small CPU box in front of the boxes above (deploys/router.py,
# docs/router.md). Uncomment to use it; clients then talk to http://192.168.1.40:8000/v1.
# routers = [
#     ("router-1", {"ssh_hostname": "192.168.1.40", "router_policy": "cache_aware"}),
# ]
