"""Multi-turn environments: episodes of model turns and environment turns, token in and token out.

    base.py        the Environment Protocol (reset, step), Turn, and the registry of environments by name
    config.py      ``environment.*``: which environment, its workers, timeout and turn limits
    pool.py        the worker processes every reset and step runs in (a timeout each, a crashed worker replaced)
    chat.py        an environment turn as token ids, through the model's own chat template
    episodes.py    one episode, turn by turn: engine results in, the next turn's request or a sample out
    lookup.py      our own: a lookup-tool task the tiny model learns on a CPU
    gymnasium_env.py, verifiers_env.py   adapters to other packages' environments (each an extra)

May import: types, control/, rollout/ (tasks, workers). The adapters import their package inside themselves only:
``import rolloutpipe`` never pulls gymnasium or verifiers.
"""
