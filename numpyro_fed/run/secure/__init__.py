"""Secure aggregation: the server learns only the sum over clients of a round's terms.

Two aggregators serve an exchange's ``secure_sum`` fields
(:class:`~numpyro_fed.run.protocol.Exchange`):

- ``"trusted"``: a trusted aggregator sums them (Heikkilä et al.'s (2023) black-box secure
  summation; over Flower a SuperNode of its own);
- ``"masking"``: no third party; the clients mask their fixed-point terms pairwise and the
  server removes the masks, recovering clients that drop (Bonawitz et al. 2017,
  :mod:`~numpyro_fed.run.secure.masking`).
"""

from .fixed_point import FRACTION_BITS, LIMIT, decode_message, encode_message, fixed_point_sum, sums_like, word_count
from .masking import SecureAggregationError, default_threshold, masked_sum, protocol_bytes

AGGREGATORS = ("trusted", "masking")
"""How an exchange's ``secure_sum`` fields are summed."""

def check_aggregation(value, owner: str):
    """``value`` as an aggregation (``None`` or one of :data:`AGGREGATORS`), or a ``ValueError``
    naming ``owner``."""
    if value is None or value in AGGREGATORS:
        return value
    raise ValueError(f"{owner}(secure_aggregation={value!r}): choose None or one of {AGGREGATORS}")

__all__ = [
    "AGGREGATORS",
    "FRACTION_BITS",
    "LIMIT",
    "SecureAggregationError",
    "check_aggregation",
    "decode_message",
    "default_threshold",
    "encode_message",
    "fixed_point_sum",
    "masked_sum",
    "protocol_bytes",
    "sums_like",
    "word_count",
]
