"""coda.agent — the agent: providers, the loop, prompts and run folders (its commands live in
``coda.cli``).

Entry points: ``synthesize(block, runs_dir, provider=...)`` starts a run and ``resume(run, block,
provider)`` continues one (``synthesize.py``); both return an ``AgentResult``. ``AgentLoop``
(``loop.py``) is the loop itself; ``providers`` holds the model adapters (``builtin`` drives
``coda.planner``'s search); ``transcript``/``runs`` what a run leaves on disk.
"""
