---- MODULE Tiny ----
\* A counter used by tests/model to pin TLC's exit codes and -tool output (not part of the product model).
EXTENDS Naturals
VARIABLES x, lastAction
vars == <<x, lastAction>>
Init == x = 0 /\ lastAction = [name |-> "Init"]
Inc == x < 3 /\ x' = x + 1 /\ lastAction' = [name |-> "Inc", by |-> 1]
Next == Inc
Spec == Init /\ [][Next]_vars
SpecWF == Spec /\ WF_vars(Next)
Small == x < 2
Reaches5 == <>(x = 5)
Reaches3 == <>(x = 3)
StepsByOne == [][x' = x + 1]_vars
StepsByTwo == [][x' = x + 2]_vars
BadEval == x + "a" > 0
TypeOK == x \in 0..3
====
