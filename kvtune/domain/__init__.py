"""The floor: plain shared types every feature package may import.

Frozen dataclasses and their strict (de)serialisation; no I/O, and no import of a feature
package (bench, policy, sim, gateway, deploy, …), so a type used by several of them lives here
rather than in one of them, and the feature packages never import each other for a type.
"""
