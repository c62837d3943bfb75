"""Progress in a log file: whole lines, at most one per LOG_EVERY_S seconds and one at the end,
no carriage returns, nothing for work done within LOG_EVERY_S; on a terminal, tqdm's bar."""

import io

from ddpgpt import progress


class Log(io.StringIO):
    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_and_the_last_count(monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # every redraw is due
    log = Log()
    for _ in progress.bar(range(5), stream=log, desc="prepare", unit="unit"):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("prepare:   0%") and "0/5" in lines[0]
    assert lines[-1].startswith("prepare: 100%") and "5/5" in lines[-1]


def test_a_log_gets_the_end_once_and_every_change_of_postfix(monkeypatch):
    """tqdm's close redraws its last update, which differs only in its clock and rate: that is
    one line in a log, not two; a postfix set at the same count is news and is kept."""
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    log = Log()
    b = progress.bar(total=3, stream=log, desc="train")
    for step in range(3):
        b.update(1)
        b.set_postfix(loss=step)
    b.close()
    lines = log.getvalue().splitlines()
    assert lines[-1].startswith("train: 100%") and lines[-1].endswith("loss=2]")
    assert [line for line in lines if "3/3" in line and "loss=2]" in line] == [lines[-1]]
    assert sum("2/3" in line for line in lines) == 2  # the count, then its new postfix


def test_quick_work_leaves_no_line_in_a_log():
    log = Log()
    for _ in progress.bar(range(1000), stream=log, desc="prepare"):
        pass
    assert log.getvalue() == ""


def test_a_terminal_gets_tqdms_bar():
    term = Terminal()
    for _ in progress.bar(range(10), stream=term, desc="eval"):
        pass
    assert "\r" in term.getvalue() and "10/10" in term.getvalue()
