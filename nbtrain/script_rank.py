"""`nbtrain.script_rank.rank_main` under its first name, for a bootstrap written by an earlier
nbtrain; the rank side of script mode is `nbtrain.rank.script_main`."""
from .rank.script_main import PAYLOAD, pipe_name, rank_main  # noqa: F401
