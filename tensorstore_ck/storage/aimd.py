"""The S3 client's send rate under throttling: additive increase, multiplicative decrease,
and cuts that stop where they do not help.

botocore's adaptive mode cuts its rate (CUBIC, by 0.7) on every throttled answer, which
is right against a per-prefix request rate (every client that cuts lowers the share
refused) and ruinous against a server that answers a steady share of the requests with
SlowDown whatever the rate (a prefix shared with other busy clients: S3's rates are per
prefix, and it splits a busy one only over minutes): the cuts never lower the share, so
the rate reaches its floor within a second and stays there. At half the answers
SlowDown, 55 requests were served in a minute (1.2 s unthrottled); at 70% the put failed.

AimdRate (the limiter's rate: storage/s3.py _add_rate_limiter):
- a throttled answer cuts the rate by BETA (at most once per MIN_GAP: a burst of answers
  to requests sent together is one signal), down to FLOOR requests/s, never below: each
  request still goes out, so a put makes progress while the server serves any share;
- each success adds INCREASE / rate (INCREASE requests/s per second at full success);
- per WINDOW seconds (and MIN_ANSWERS answers) it notes the share of throttled answers
  and the rate. When it cut over the last WINDOWS windows and the share did not fall
  (to 0.8 of what it was), cutting does not help: the rate goes back to the highest of
  those windows and cuts pause for HOLD seconds (doubling while it keeps happening, up
  to MAX_HOLD; halved back each time a cut helps), each success adding a request/s
  meanwhile (slow start). Against a per-prefix rate, cuts lower the share and it
  behaves as a plain AIMD limiter.
Whether a put still makes progress is RetryingStore's to judge (storage/wrappers.py: a
throttled request gives up once no request of the store has succeeded for the whole
retry budget), naming the throttling.

The interface is botocore's rate adjustor's (throttling.CubicCalculator's), which
aiobotocore's AsyncClientRateLimiter drives: success_received(t) and
error_received(measured_rate, t) each return the new rate.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["AimdRate"]


class AimdRate:
    BETA = 0.7
    MIN_GAP = 0.1
    INCREASE = 2.0
    FLOOR = 1.0
    START = 50.0
    WINDOW = 1.0
    WINDOWS = 2
    MIN_ANSWERS = 4  # a window with fewer answers says nothing
    HOLD, MAX_HOLD = 2.0, 60.0

    def __init__(self, start_time: float):
        self.rate: float | None = None  # None: no throttled answer yet (the limiter is off)
        self.cut_at = start_time - self.MIN_GAP
        self.hold, self.hold_until = self.HOLD, start_time
        self._win_start, self._answers, self._throttled, self._win_rate = start_time, 0, 0, 0.0
        self._windows: collections.deque = collections.deque(maxlen=self.WINDOWS)  # (share, rate)
        self._cuts_seen = 0  # cuts since the last judgement
        self._lock = threading.Lock()

    def _note(self, t: float, throttled: bool) -> None:
        self._answers += 1
        self._throttled += throttled
        if self.rate is not None:
            self._win_rate = max(self._win_rate, self.rate)
        if t - self._win_start < self.WINDOW:
            return
        if self._answers >= self.MIN_ANSWERS and self.rate is not None:
            self._windows.append((self._throttled / self._answers, self._win_rate))
            self._judge(t)
        self._win_start, self._answers, self._throttled, self._win_rate = t, 0, 0, 0.0

    def _judge(self, t: float) -> None:
        if len(self._windows) < self.WINDOWS:
            return
        share0, share1 = self._windows[0][0], self._windows[-1][0]
        if share0 == 0 or self._cuts_seen == 0:
            return
        self._cuts_seen = 0
        if share1 >= 0.8 * share0:  # cut, and the same share refused: not our rate's doing
            self.rate = max(r for _, r in self._windows)
            self.hold_until = t + self.hold
            self.hold = min(self.MAX_HOLD, 2 * self.hold)
        else:
            self.hold = max(self.HOLD, self.hold / 2)
        self._windows.clear()

    def success_received(self, timestamp: float) -> float:
        with self._lock:
            self._note(timestamp, False)
            if self.rate is None:
                return float("inf")  # unused while the limiter is off (it caps at twice the measured rate)
            # While cuts pause, each success adds a request/s (the rate doubles per round of
            # answers, as TCP's slow start; the limiter keeps it within twice the measured rate).
            self.rate += 1.0 if timestamp < self.hold_until else self.INCREASE / max(self.rate, self.FLOOR)
            return self.rate

    def error_received(self, current_rate: float, timestamp: float) -> float:
        with self._lock:
            self._note(timestamp, True)
            if self.rate is not None and (timestamp < self.hold_until or timestamp - self.cut_at < self.MIN_GAP):
                return self.rate
            # The first cut is from the rate measured so far (a new client's first half
            # second measures nothing yet: START, not the floor).
            base = max(current_rate, self.START) if self.rate is None else min(current_rate, self.rate)
            self.rate = max(self.FLOOR, base * self.BETA)
            self.cut_at = timestamp
            self._cuts_seen += 1
            return self.rate
