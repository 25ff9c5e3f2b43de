"""Where an exported job's `run.sh` written before the notebook side's wings (0.2) finds its entry
(`from nbtrain.notebook.exported_job import main`): such a job directory still runs."""
from .detached.exported_job import main

__all__ = ["main"]
