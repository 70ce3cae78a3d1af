"""Our own decoding runtime: static-cache target, EAGLE-2 trees, speculative and plain decoders;
the session that loads them in a tuned tree shape is decode.session."""

from eagletools.decode.engine import BaselineDecoder, Result, SpeculativeDecoder
from eagletools.decode.model import Transformer
from eagletools.decode.sampling import Sampling

__all__ = ["BaselineDecoder", "Result", "Sampling", "SpeculativeDecoder", "Transformer"]
