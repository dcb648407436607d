"""rope: rotary position embedding in Triton, with TransformerEngine's API and semantics."""
from . import reference
from ._table import set_angle_table
from ._validate import set_value_checks
from .embedding import RotaryPositionEmbedding
from .functional import apply_rotary_pos_emb, apply_rotary_pos_emb_qk

__all__ = [
    "apply_rotary_pos_emb", "apply_rotary_pos_emb_qk", "RotaryPositionEmbedding", "reference", "set_angle_table",
    "set_value_checks",
]
__version__ = "0.1.0"
