"""The control plane both node groups share: what crosses between them, and how.

    env.py          the node environment contract (RP_* variables, Slurm het-job derivation, ports, sockets)
    transport.py    the TCPStore: run-scoped keys, sealed records, signed group handles, payloads, abort
    liveness.py     heart-beats and the check that the peers still beat
    codec.py        a complete group as safetensors bytes and back
    clock.py        one clock for every span of the run (the store host's)
    weights/        how policy k+1 reaches the engines: one module per way (disk, distributed), both sides in it
    checkpoint.py   the step-atomic checkpoint layout (the trainer writes it, both sides resume from it)
    lifetime.py     stop signals and process groups: every process the run starts stops with it

May import: types, model. Nothing of rollout/, trainer/, observe/, launch/ or config.
"""
