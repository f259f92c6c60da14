---------------------------- MODULE ResetEpoch ----------------------------
(***************************************************************************)
(* reset_cache against a shared store (spec/README.md S10 NoPreResetLoad): *)
(* once a reset is done, no load returns KV stored before it.  One engine  *)
(* saves and loads blocks; any other client of the store may read every   *)
(* object and put one back under the key it came from once that key is    *)
(* empty (first writer wins; the integrity tag binds an object to its own  *)
(* key, so it loads nowhere else); objects are evicted at any time.        *)
(*                                                                         *)
(* A value in the store is the engine epoch its KV was computed in: after  *)
(* a reset the engine's KV is of the new epoch, and a load that returns an *)
(* older epoch's value is a pre-reset load.                                *)
(*                                                                         *)
(*  - fixed (Legacy = FALSE), kvledger_connector/scheduler/reset.py: a     *)
(*    reset moves the keys (a fresh reset epoch in every key's digest),    *)
(*    and removes the old keys later, best-effort (Remove may never run). *)
(*  - legacy (Legacy = TRUE), the keys stay where they are: the reset      *)
(*    removes them all at once (the best a removal can do; lookups missed  *)
(*    until it was done) and the next load may find an object another      *)
(*    client put back after the removal: MC_legacy_reset_replay.           *)
(*                                                                         *)
(* Both keep the reset's refusal rule (no put in flight: Reset needs       *)
(* inflight = {}); Mutant "NoRefusal" drops it: under moved keys a put     *)
(* landing after the reset lands under an old key, which nothing reads.   *)
(***************************************************************************)
EXTENDS Integers

CONSTANTS Blocks,      \* block contents (chained hashes) the engine saves and loads
          MaxResets,   \* resets in a behaviour
          Legacy,      \* TRUE: the keys stay where they are at a reset
          Mutant       \* "none" | "NoRefusal"

None == -1   \* an empty key (an integer: TLC compares values of one kind only)
Epochs == 0..MaxResets
KeyOf(b, e) == IF Legacy THEN <<b, 0>> ELSE <<b, e>>
Keys == Blocks \X Epochs

VARIABLES
    epoch,      \* the engine's reset epoch (its keys' while Legacy = FALSE)
    store,      \* key -> the epoch of the KV stored under it, or None
    inflight,   \* puts the engine emitted and the store has not yet applied: <<key, value>>
    copies,     \* objects another client read: <<key, value>>
    removed,    \* epochs whose keys the engine has removed (fixed design, after the reset)
    loaded,     \* the last load: <<value's epoch, engine epoch>> (<<0, 0>> before any)
    lastAction  \* the step's action and arguments (counterexample stories)

vars == <<epoch, store, inflight, copies, removed, loaded, lastAction>>

TypeOK ==
    /\ epoch \in Epochs
    /\ store \in [Keys -> (Epochs \cup {None})]
    /\ inflight \subseteq Keys \X Epochs
    /\ copies \subseteq Keys \X Epochs
    /\ removed \subseteq Epochs
    /\ loaded \in Epochs \X Epochs

Init ==
    /\ epoch = 0
    /\ store = [k \in Keys |-> None]
    /\ inflight = {}
    /\ copies = {}
    /\ removed = {}
    /\ loaded = <<0, 0>>
    /\ lastAction = [name |-> "Init"]

\* The engine saves block b: a put of this epoch's KV under the key it builds now.
Save(b) ==
    /\ <<KeyOf(b, epoch), epoch>> \notin inflight
    /\ inflight' = inflight \cup {<<KeyOf(b, epoch), epoch>>}
    /\ lastAction' = [name |-> "Save", b |-> b]
    /\ UNCHANGED <<epoch, store, copies, removed, loaded>>

\* The store applies a put: first writer wins.
Put(p) ==
    /\ p \in inflight
    /\ inflight' = inflight \ {p}
    /\ store' = IF store[p[1]] = None THEN [store EXCEPT ![p[1]] = p[2]] ELSE store
    /\ lastAction' = [name |-> "Put", k |-> p[1]]
    /\ UNCHANGED <<epoch, copies, removed, loaded>>

\* The engine loads block b from the key it builds now.
Load(b) ==
    /\ store[KeyOf(b, epoch)] # None
    /\ loaded' = <<store[KeyOf(b, epoch)], epoch>>
    /\ lastAction' = [name |-> "Load", b |-> b]
    /\ UNCHANGED <<epoch, store, inflight, copies, removed>>

\* reset_cache: refused while a put is in flight; the keys move (fixed) or are all removed (legacy).
Reset ==
    /\ epoch < MaxResets
    /\ Mutant = "NoRefusal" \/ inflight = {}
    /\ epoch' = epoch + 1
    /\ store' = IF Legacy THEN [k \in Keys |-> None] ELSE store
    /\ lastAction' = [name |-> "Reset"]
    /\ UNCHANGED <<inflight, copies, removed, loaded>>

\* The removal of an old epoch's keys, off the engine thread, whenever it gets to run (if ever).
Remove(e) ==
    /\ ~Legacy /\ e < epoch /\ e \notin removed
    /\ removed' = removed \cup {e}
    /\ store' = [k \in Keys |-> IF k[2] = e THEN None ELSE store[k]]
    /\ lastAction' = [name |-> "Remove", e |-> e]
    /\ UNCHANGED <<epoch, inflight, copies, loaded>>

\* Another client reads an object, and later puts it back under its key once that key is empty.
Steal(k) ==
    /\ store[k] # None
    /\ copies' = copies \cup {<<k, store[k]>>}
    /\ lastAction' = [name |-> "Steal", k |-> k]
    /\ UNCHANGED <<epoch, store, inflight, removed, loaded>>

Replay(c) ==
    /\ c \in copies /\ store[c[1]] = None
    /\ store' = [store EXCEPT ![c[1]] = c[2]]
    /\ lastAction' = [name |-> "Replay", k |-> c[1]]
    /\ UNCHANGED <<epoch, inflight, copies, removed, loaded>>

Evict(k) ==
    /\ store[k] # None
    /\ store' = [store EXCEPT ![k] = None]
    /\ lastAction' = [name |-> "Evict", k |-> k]
    /\ UNCHANGED <<epoch, inflight, copies, removed, loaded>>

Next ==
    \/ \E b \in Blocks : Save(b) \/ Load(b)
    \/ \E p \in inflight : Put(p)
    \/ Reset
    \/ \E e \in Epochs : Remove(e)
    \/ \E k \in Keys : Steal(k) \/ Evict(k)
    \/ \E c \in copies : Replay(c)

Spec == Init /\ [][Next]_vars

\* States that differ only in lastAction are one state.
View == <<epoch, store, inflight, copies, removed, loaded>>

\* S10: a load after a reset never returns KV stored before it.
NoPreResetLoad == loaded[1] = loaded[2]

\* Why it holds under moved keys: a key of epoch e only ever holds KV of epoch e.
KeysHoldTheirEpoch == ~Legacy => \A k \in Keys : store[k] \in {None, k[2]}

\* S10's hazard (conformance/witness.py): a pre-reset object put back after its keys' removal.
Witness_S10 == \E c \in copies : c[2] < epoch /\ store[c[1]] = c[2] /\ (Legacy \/ c[2] \in removed)
NotWitness_S10 == ~Witness_S10
=============================================================================
