"""A prompt run until the caches end it, by a speculative scheduler and by the plain one on the same engine: the
tests of how much room a speculative step needs compare the two."""
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler


def to_the_end(sched, engine, prompt: list[int], max_tokens: int = 100) -> tuple[Request, Request]:
    """(the request as `sched` ran it, the same request run by a plain Scheduler of `engine`), greedy, EOS ignored,
    each run until idle."""
    r = sched.submit(Request(prompt, SamplingParams(), max_tokens, ignore_eos=True))
    sched.run_until_idle()
    plain = Scheduler(engine)
    ref = plain.submit(Request(prompt, SamplingParams(), max_tokens, ignore_eos=True))
    plain.run_until_idle()
    return r, ref
