"""The suite: running the notebooks and delivering their results (the top layer).
The headless runner, the batch REPORT, the cold-start cell and its writing into the notebooks,
Kaggle staging, and ``paths``: the one place naming the repository, its notebooks and GitHub home."""
