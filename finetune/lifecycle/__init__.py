"""One run's lifecycle, both backends alike: its state (``run_state``), the accumulation window (``window``),
checkpoints and resume (``checkpoint``, ``elastic``, ``preemption``, ``progress``), evaluation, the output
directory, the log, the Hub, the card and the reports, and the resolution of a run (``resolve``)."""
