"""One thread for every test process (pytest-xdist runs one a core) and every process a test starts,
unless OMP_NUM_THREADS says otherwise: the tests' models are tiny, so a second thread mostly waits
at every small op for the first, and on a core that something else keeps busy such a wait took a
60-step overfit from 1 s to 15 s."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
