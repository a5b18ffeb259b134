"""coda.evals — the eval harness, its metrics and reports, and the regression store.

* ``suites`` — named suites (``evals/suites/*.toml``) → the blocks to run;
* ``spec`` — providers, the eval spec (blocks × providers × seeds) and its cells;
* ``cell`` — run (or continue, or read back) one cell; ``harness`` — run an eval's pending cells
  in process, in worker processes (``worker``), or as Ray tasks (``distributed``);
* ``results`` — the eval folder and ``results.jsonl``; ``metrics`` — pass@k, fast_p, speedups;
  ``report`` / ``plots`` — ``results.md`` and the PNGs; ``compare`` — diff two evals;
* ``store`` — regression stores (``<store>/<block>/<name>.json``: the built-in
  ``evals/regression/``, and the user's, where ``accept`` writes): accept, regress;
* ``trajectories`` — JSONL export for fine-tuning or RL.

Their commands (``eval``, ``accept``, ``regress``, ``export-trajectories``) live in ``coda.cli``.

Dependencies point one way: ``primitives``, ``blocks`` → ``sandbox`` → ``agent`` → ``evals``.
"""
