"""The warm template under its first name: `nbtrain.template.template()`, `warm_up()`, `stop()`
(now in `nbtrain.placements.template_process`), and `python -m nbtrain.template`, which a
template started by an earlier nbtrain may still be running (now `nbtrain.rank.template_main`)."""
import sys

from .placements.template_process import Template, stop, template, warm_up  # noqa: F401

if __name__ == "__main__":
    from .rank.template_main import _serve

    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
