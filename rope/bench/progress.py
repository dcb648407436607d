"""A progress bar on stderr: tqdm when installed, otherwise one line per step."""
from __future__ import annotations

import sys
import time


class _Lines:
    def __init__(self, total, desc):
        self.total, self.n, self.desc, self.t0 = total, 0, desc, time.perf_counter()

    def set_postfix_str(self, text):
        print(f"[{self.n + 1}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr,
              flush=True)

    def update(self, k=1):
        self.n += k

    def write(self, text):
        print(text, file=sys.stderr, flush=True)

    def close(self):
        pass


class Progress:
    def __init__(self, total: int, desc: str = "rope.bench", enabled: bool = True):
        self._bar = None
        if not enabled:
            self._bar = _Silent()
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
        except ImportError:
            self._bar = _Lines(total, desc)

    def step(self, text: str):
        self._bar.set_postfix_str(text)

    def done(self, k: int = 1):
        self._bar.update(k)

    def write(self, text: str):
        self._bar.write(text)

    def close(self):
        self._bar.close()


class _Silent(_Lines):
    def __init__(self):
        super().__init__(0, "")

    def set_postfix_str(self, text):
        pass

    def write(self, text):
        pass
