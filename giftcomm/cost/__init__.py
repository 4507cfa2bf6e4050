"""The cost model: predicted time of every algorithm and the ``auto`` choice (:mod:`giftcomm.cost.model`),
with its constants from the calibration file (:mod:`giftcomm.cost.calibration`). The formulas
themselves are the algorithm table's (giftcomm.algorithms). Importing this package imports
neither module."""
