"""The IR: its values, nodes and graphs (`graph`), op traits, the text form and its
rendering, the verifier, and the walks and dataflow queries the passes share."""
