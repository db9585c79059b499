"""The conformance cases (collected by pytest; a package so that they ship in the wheel)."""
