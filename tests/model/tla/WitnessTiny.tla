---- MODULE WitnessTiny ----
\* tests/model: witnesses on the Tiny counter (x = 0..3) for conformance.witness: two reachable, two not.
EXTENDS Tiny
Witness_Two == x = 2
Witness_Seven == x = 7
Witness_Inc == x' = x + 1
Witness_Jump == x' = x + 2
NotWitness_Two == ~Witness_Two
NotWitness_Seven == ~Witness_Seven
NotWitness_Inc == [][~Witness_Inc]_vars
NotWitness_Jump == [][~Witness_Jump]_vars
====
