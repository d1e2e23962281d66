"""Decode-time SSM state update (one token per row, slot-indexed state cache)."""

from pallas_kernels.state_update.api import selective_state_update

__all__ = ["selective_state_update"]
