"""Driving one session by hand, where a test reads the session after its rows finish (its cache, its
rows): the engine core (`fastforward.decoding.engine_core`) would have taken finished rows out."""

from fastforward.decoding.decoders import Decoder
from fastforward.decoding.runtime import Session


def decode(decoder: Decoder, session: Session) -> None:
    """Begin every row of `session` and step until all have finished; the finished rows stay."""
    decoder.begin(session, range(session.batch))
    while not session.finished:
        decoder.step(session)
