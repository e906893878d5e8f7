"""The vocabulary every layer speaks: errors, reduce ops, trees, patching, the replica
context, layouts, and the Protocols the layers below the `Strategy` base read a strategy
through. Imports nothing of the package."""
