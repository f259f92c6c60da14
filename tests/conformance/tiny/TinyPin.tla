---------------------------- MODULE TinyPin ----------------------------
(* A miniature of the pinned-job rule, used only to test the conformance  *)
(* tooling (export, coverage, trace check) without the full model:        *)
(* a request emits store jobs that pin its block; ranks report; Collect   *)
(* releases the pin when every rank reported.                             *)
EXTENDS Naturals, FiniteSets, TLC
CONSTANTS Ranks, MaxJobs

VARIABLES nextJob, pinned, reported, lastAction
vars == <<nextJob, pinned, reported, lastAction>>

Init == /\ nextJob = 1
        /\ pinned = {}
        /\ reported = [w \in Ranks |-> {}]
        /\ lastAction = [name |-> "Init"]

EmitStore == /\ nextJob <= MaxJobs
             /\ pinned' = pinned \cup {nextJob}
             /\ nextJob' = nextJob + 1
             /\ UNCHANGED reported
             /\ lastAction' = [name |-> "EmitStore", job |-> nextJob]

Report(w, j) == /\ j \in pinned
                /\ j \notin reported[w]
                /\ reported' = [reported EXCEPT ![w] = @ \cup {j}]
                /\ UNCHANGED <<nextJob, pinned>>
                /\ lastAction' = [name |-> "Report", w |-> w, job |-> j]

Collect(j) == /\ j \in pinned
              /\ \A w \in Ranks : j \in reported[w]
              /\ pinned' = pinned \ {j}
              /\ reported' = [w \in Ranks |-> reported[w] \ {j}]
              /\ UNCHANGED nextJob
              /\ lastAction' = [name |-> "Collect", job |-> j]

Next == \/ EmitStore
        \/ \E w \in Ranks, j \in pinned : Report(w, j)
        \/ \E j \in pinned : Collect(j)

Spec == Init /\ [][Next]_vars

ReportedOnce == \A w \in Ranks : reported[w] \subseteq pinned
=============================================================================
