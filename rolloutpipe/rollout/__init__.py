"""The rollout node group (het group 0): prompts, admission, engines, rewards, complete groups, the dispatcher.

    node.py        the rollout node's parts and its bookkeeping around a step (pipeline.py runs the step)
    config.py      ``rollout.*``: engines, admission, dynamic sampling, failure budgets
    admission.py   pure scheduling: batch membership (StepSlots), FIFO/FGD admission, group assembly
    samples.py     requests (seeded by their ids) and the reward threads that turn results into samples
    rewards.py     reward functions and the worker pool that runs them with a timeout
    answers.py     reading the final answer out of a response (math and gpqa): after the thinking, linear
    dispatcher.py  the CGP dispatcher thread: complete groups -> signed handles in the store
    supervisor.py  engine failures: resubmit a failed engine's requests, restart it
    data.py        prompt rows (jsonl/parquet) and the prompt source;  tasks.py  the synthetic task
    engines/       the Engine protocol, the embedded engine, the SGLang client, server processes

May import: types, model, config, control/, observe/. Never trainer/: what both sides share is in control/.
"""
