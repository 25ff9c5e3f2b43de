"""The IPython front end: the magics, their options, the cell as a job, where the kernel runs."""
