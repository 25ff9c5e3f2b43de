"""A stuck or crashed rank's stacks read into what the user sees: the collective it waits in and
the user's line that called it (`blocked_on_peers`), its own frames first (`tidy_stacks`), what
a rank killed by a signal said last (`fatal_report`, `last_words`). faulthandler's text, as a
rank writes it (most recent call first)."""
from nbtrain.notebook.run.stacks import blocked_on_peers, exception_message, fatal_report, last_words, tidy_stacks

TORCH = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{TORCH}/distributed/distributed_c10d.py"
LOGGER = f"{TORCH}/distributed/c10d_logger.py"


def stack(*frames: tuple[str, int, str], thread: str = "Current thread 0x00007f01 (most recent call first):") -> str:
    return "\n".join([thread, *(f'  File "{file}", line {line} in {func}' for file, line, func in frames)])


def test_a_barrier_names_the_user_s_line_past_torch_s_wrappers():
    waiting = stack((C10D, 4200, "barrier"), (LOGGER, 81, "wrapper"), ("/tmp/ipykernel_7/31.py", 7, "train"),
                    ("/home/me/nbtrain/nbtrain/rank/loop.py", 140, "_do_run"))
    assert blocked_on_peers(waiting) == "barrier (31.py line 7 in train)"


def test_a_users_folder_named_like_a_library_is_the_users_and_nbtrain_elsewhere_is_not():
    # A clone named nbtrain (its tests), a project named torch; nbtrain's own frames on another machine.
    for mine in ("/home/me/nbtrain/tests/test_doctor.py", "/home/me/torch/train.py"):
        waiting = stack((C10D, 2800, "all_reduce"), ("/elsewhere/src/nbtrain/nbtrain/rank/context.py", 300,
                                                      "all_reduce"), (mine, 9, "train"))
        assert blocked_on_peers(waiting) == f"all_reduce ({mine.rsplit('/', 1)[1]} line 9 in train)"


def test_the_outermost_collective_is_named_the_one_the_user_called():
    # init_process_group waits in the rendezvous, which waits in the store: the user called the first.
    waiting = stack((f"{TORCH}/distributed/rendezvous.py", 60, "_create_c10d_store"),
                    (f"{TORCH}/distributed/rendezvous.py", 120, "_env_rendezvous_handler"),
                    (C10D, 1500, "init_process_group"), (LOGGER, 81, "wrapper"), ("train.py", 3, "main"))
    assert blocked_on_peers(waiting) == "init_process_group (train.py line 3 in main)"


def test_ddp_s_start_up_sync_is_named_with_the_line_that_wrapped_the_model():
    waiting = stack((f"{TORCH}/distributed/utils.py", 300, "_sync_module_states"),
                    (f"{TORCH}/nn/parallel/distributed.py", 820, "__init__"), ("/work/fit.py", 12, "setup"))
    assert blocked_on_peers(waiting) == "_sync_module_states (fit.py line 12 in setup)"


def test_a_collective_without_a_caller_outside_torch_is_named_alone():
    assert blocked_on_peers(stack((C10D, 2800, "all_reduce"), (LOGGER, 81, "wrapper"))) == "all_reduce"


def test_a_rank_that_computes_or_only_asks_its_rank_is_not_blocked():
    assert blocked_on_peers(stack(("/work/fit.py", 20, "step"), ("/work/fit.py", 30, "train"))) is None
    assert blocked_on_peers(stack((C10D, 900, "get_rank"), ("/work/fit.py", 5, "train"))) is None  # returns at once
    # A function named like a collective outside torch.distributed is the user's own.
    assert blocked_on_peers(stack(("/work/fit.py", 5, "all_reduce"), ("/work/fit.py", 9, "train"))) is None
    assert blocked_on_peers("") is None


def test_the_thread_that_waits_is_found_among_the_others():
    idle = stack(("/usr/lib/python3.11/threading.py", 320, "wait"),
                 thread="Thread 0x00007f02 (most recent call first):")
    waiting = stack((C10D, 3100, "broadcast"), ("/work/fit.py", 44, "sync"))
    assert blocked_on_peers(idle + "\n\n" + waiting) == "broadcast (fit.py line 44 in sync)"


def test_tidy_stacks_drops_nbtrain_s_threads_and_frames_below_the_user_s_code():
    own = stack(("/x/nbtrain/common/channel.py", 50, "_send_loop"), thread="Thread 0x2 (most recent call first):")
    main = stack(("/tmp/ipykernel_7/31.py", 7, "train"), ("/x/nbtrain/rank/loop.py", 140, "_do_run"),
                 ("/x/nbtrain/rank/loop.py", 101, "_execute"))
    tidied = tidy_stacks(own + "\n\n" + main + "\n\nExtension modules: torch._C (total: 1)")
    assert tidied == stack(("/tmp/ipykernel_7/31.py", 7, "train"))


CRASH = ["[rank 1] loading", "Fatal Python error: Segmentation fault", "",
         stack(("/work/fit.py", 3, "crash")), "", "Extension modules: torch._C (total: 1)"]


def test_a_fatal_signal_s_report_is_found_in_the_rank_s_stderr():
    report = fatal_report("\n".join(CRASH).splitlines())
    assert report.startswith("Fatal Python error: Segmentation fault") and "fit.py\", line 3 in crash" in report
    assert "[rank 1] loading" not in report
    assert fatal_report(["just a warning", "and another"]) == ""


def test_last_words_are_the_report_or_else_the_last_lines():
    said = last_words("\n".join(CRASH).splitlines())
    assert said.startswith("Fatal Python error: Segmentation fault") and "Extension modules" not in said
    chatter = [f"line {i}" for i in range(100)]
    assert last_words(chatter) == "\n".join(chatter[-40:])  # no report: the last 40 lines


# A C++ exception that ended a rank: libstdc++'s handler (then faulthandler's report), or a handler
# that another library installed (Ray's, in a fork of a kernel that imported ray), which writes its
# own stacks and silences faulthandler.
ENFORCE = ("[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length <= "
           "op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is there a distributed collective "
           "mismatch in your code?")
MESSAGE = ENFORCE.split("] ", 1)[1]


def test_a_cpp_exception_s_message_is_read_without_its_source_place_or_a_handler_s_frames():
    libstdcxx = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'", f"  what():  {ENFORCE}",
                 "Fatal Python error: Aborted", "", 'Thread 0x1 (most recent call first):',
                 '  File "train.py", line 9 in main']
    assert exception_message("\n".join(libstdcxx)) == MESSAGE
    ray = [f"[2026-11-26 10:50:34,932 E 29331 29349] logging.cc:118: Unhandled exception: N4gloo13EnforceNotMetE. "
           f"what(): {ENFORCE} /venv/lib/python3.11/site-packages/ray/_raylet.so(+0x1812b9a) [0x7f9c] "
           "ray::operator<<()"] + [f"/lib/libstdc++.so.6(+0xa8e{i}) [0x7f9d] frame{i}" for i in range(30)]
    assert exception_message("\n".join(ray)) == MESSAGE
    said = last_words(["earlier chatter"] * 50 + ray)  # from the exception on, though its stacks run long
    assert said.startswith("[2026-11-26") and said.endswith("frame29") and "earlier chatter" not in said
    assert exception_message("Fatal Python error: Segmentation fault") is None
