"""The serve tests' clock: load time that moves only when read or slept, so arrivals seconds apart cost nothing."""


class FakeClock:
    """Each read advances `tick` seconds (work takes time); `sleep` jumps, and is remembered in `slept_s`."""

    def __init__(self, tick: float = 0.01):
        self.now, self.tick, self.slept_s = 0.0, tick, []

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now += seconds
