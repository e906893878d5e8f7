"""Exit statuses the worker scripts report with, for the tests that read them; importing
it sets nothing up (a worker script's own import sets its process's device count)."""

#: `join.py`: a start-up fault was caught as the error the README promises
CAUGHT_STATUS = 5
