"""Launching: both node groups with the same resolved config, on this machine or as a Slurm het job.

    config.py        ``launcher.*``: which launcher, Slurm resources per het group
    local.py         LocalLauncher (both node groups as local processes), prepare_run
    slurm.py         SlurmLauncher (one heterogeneous job through submitit), check_allocation for sbatch
    submitit_het.py  the submitit extension for het jobs;  sacct.py  sacct's rows folded into one state
    node.py          the entry point of every node-group process: ``python -m rolloutpipe.launch.node``
    preflight.py     checks of the model at launch; memory_plan.py  estimated peak GPU memory per rank and
                     engine (tools/memory_plan.py prints it, GPU launchers warn from it)
    host_memory.py   estimated host memory per node (restore points, rank 0's copies), against launcher.*.mem_gb
    model_shapes.py  the model shapes a plan reads (an HF config.json, --model-shape) and a layer's activations

May import: types, model, config, control/, observe/, rollout/, trainer/, pipeline. submitit only inside
submitit_het.py.
"""
