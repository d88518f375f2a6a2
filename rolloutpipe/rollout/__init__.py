"""The rollout node group (het group 0): prompts, admission, engines, rewards, complete groups, the dispatcher.

    node.py        the rollout node's parts and its bookkeeping around a step (pipeline.py runs the step)
    config.py      ``rollout.*``: engines, admission, dynamic sampling, failure budgets
    admission.py   which engine gets which request: Admission, its FIFO/FGD policies and their one registration
    slots.py       batch membership (StepSlots) and FGD's frontier;  schedule.py  one step's RolloutSchedule
    groups.py      rewarded samples -> complete groups;  advantages.py  GRPO advantages of one group
    samples.py     requests (seeded by their ids) and the reward threads that turn results into samples
    rewards.py     reward functions and the worker pool that runs them with a timeout
    workers.py     a worker process answering JSON calls with a timeout (rewards' and environments')
    environments/  multi-turn episodes: the Environment Protocol, its workers, our own and adapters
    answers.py     reading the final answer out of a response (math and gpqa): after the thinking, linear
    dispatcher.py  the CGP dispatcher thread: complete groups -> signed handles in the store
    data.py        prompt rows (jsonl/parquet) and the prompt source;  tasks.py  the synthetic task
    engines/       the Engine protocol, the embedded engine, the SGLang client, server processes, the engine hosts
                   of several rollout nodes, and the supervisor of engine failures

May import: types, model, control/, observe/; node.py also config. Never trainer/: what both sides share is in
control/. Only node.py, the top of the wing, reads the root Config; every other module takes its own section.
"""
