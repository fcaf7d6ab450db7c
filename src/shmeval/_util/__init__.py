"""Private helpers that the applications (``shmeval selfplay``, ``shmeval
bench``, the scripts in bench/) share: process and machine figures from
/proc, the status line, JSON output, child-process set-up and the
``multiprocessing.Queue`` evaluator's batching.  Nothing in the core
imports this package."""
