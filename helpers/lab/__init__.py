"""The lab: what the notebooks need beyond the comparison.
Run profiles, the convergence A/B (models, tasks, training loop, diagnostics, fair step times; the
corpus and the language model are ``helpers.compare``'s, the "trained" regime's), the walkthrough's
teaching helpers, the RL step (``rl``: a GRPO loss from per-token outputs) and the plots. Imports
compare, cce and spec; never the suite."""
