--------------------------- MODULE TraceTinyPin ---------------------------
(* Trace validation of TinyPin: cursor + trap invariant. TraceData.tla is  *)
(* written by conformance.engine.tracecheck from an NDJSON log.             *)
EXTENDS TinyPin, TraceData, Naturals, Sequences, TLC
VARIABLE i
tvars == <<vars, i>>

TraceInit == Init /\ i = 0

Event(e) == \/ e.action = "EmitStore" /\ EmitStore /\ lastAction'.job = e.job
            \/ e.action = "Report" /\ Report(e.w, e.job)
            \/ e.action = "Collect" /\ Collect(e.job)

TraceNext == /\ i < Len(Trace)
             /\ Event(Trace[i + 1])
             /\ i' = i + 1

TraceSpec == TraceInit /\ [][TraceNext]_tvars
\* Trap: violated exactly when the whole log was matched (TLC exit 12 = accepted).
NotFullyMatched == i < Len(Trace)
\* Records the furthest cursor reached (register 1), printed when it grows.
Furthest == IF i > TLCGet(1) THEN TLCSet(1, i) /\ PrintT(<<"cursor", i>>) ELSE TRUE
ASSUME TLCSet(1, 0)
=============================================================================
