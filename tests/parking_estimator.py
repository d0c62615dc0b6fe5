"""An estimator for tests/test_packs.py, served by the sklearn format: unpickling one with
`park_bytes` parks that much memory in this module, where it outlives the model, so the pack it
was dropped from cannot shrink by what its load added."""

import numpy as np

PARKED: list[np.ndarray] = []


class ParkingEstimator:
    def __init__(self, park_bytes: int = 0):
        self.park_bytes = park_bytes
        self.n_features_in_ = 1

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.park_bytes:
            PARKED.append(np.ones(self.park_bytes, dtype=np.uint8))

    def predict(self, rows):
        return np.asarray(rows, dtype=np.float64)[:, 0]
