//! [`AbortRecord`]: the first failure of a job, published in the store so that every rank stops
//! with the same, precise explanation instead of a cascade of "connection closed" errors.

use std::fmt;

use crate::types::CollectiveOp;
use crate::types::{CollectiveSeq, Rank, RankList};
use crate::wire::{Reader, WireError, Writer};

/// Who held up a collective that timed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StallDiagnosis {
    /// These ranks never reached the collective (or stopped making progress inside it) while
    /// every other rank waited in it: the store shows who arrived.
    Stalled(RankList),
    /// Every rank reported waiting; this rank was waiting on its neighbour.
    AllWaiting {
        /// The neighbour.
        neighbour: Rank,
    },
    /// The store could not be asked; this rank was waiting on its neighbour.
    Unknown {
        /// The neighbour.
        neighbour: Rank,
    },
}

impl StallDiagnosis {
    /// The rank to blame first.
    pub fn culprit(&self) -> Rank {
        match self {
            StallDiagnosis::Stalled(list) => list.0.first().copied().unwrap_or_default(),
            StallDiagnosis::AllWaiting { neighbour } | StallDiagnosis::Unknown { neighbour } => {
                *neighbour
            }
        }
    }
}

impl fmt::Display for StallDiagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StallDiagnosis::Stalled(list) if list.0.len() == 1 => write!(
                f,
                "rank {} never reached it (or stalled inside it) while every other rank waited",
                list.0[0]
            ),
            StallDiagnosis::Stalled(list) => write!(
                f,
                "ranks {list} never reached it (or stalled inside it) while every other rank waited"
            ),
            StallDiagnosis::AllWaiting { neighbour } => write!(
                f,
                "every rank reached it and waited (this rank on rank {neighbour}): the network between them may be down"
            ),
            StallDiagnosis::Unknown { neighbour } => write!(
                f,
                "this rank waited on rank {neighbour} (the store could not be asked which ranks arrived)"
            ),
        }
    }
}

/// The first failure of a job, as reported by the rank that saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortRecord {
    /// The rank that saw the failure.
    pub reporter: Rank,
    /// The rank at fault, when known (the one that died, stalled, or was misconfigured).
    pub culprit: Option<Rank>,
    /// The collective in progress, when the failure happened inside one.
    pub collective: Option<(CollectiveOp, CollectiveSeq)>,
    /// The reporter's full error message.
    pub reason: String,
}

impl AbortRecord {
    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u32(self.reporter.0);
        match self.culprit {
            Some(r) => w.u8(1).u32(r.0),
            None => w.u8(0),
        };
        match self.collective {
            Some((op, seq)) => w.u8(op.code()).u64(seq.0),
            None => w.u8(0),
        };
        w.str(&self.reason);
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let reporter = Rank(r.u32("reporter")?);
        let culprit = match r.u8("culprit flag")? {
            0 => None,
            1 => Some(Rank(r.u32("culprit")?)),
            _ => {
                return Err(WireError::InvalidValue {
                    what: "culprit flag",
                })
            }
        };
        let collective = match r.u8("collective")? {
            0 => None,
            code => {
                let op = CollectiveOp::from_code(code).ok_or(WireError::InvalidValue {
                    what: "collective op",
                })?;
                Some((op, CollectiveSeq(r.u64("sequence")?)))
            }
        };
        let reason = r.str("reason")?.to_owned();
        Ok(Self {
            reporter,
            culprit,
            collective,
            reason,
        })
    }
}

impl fmt::Display for AbortRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.culprit {
            Some(c) if c == self.reporter => write!(f, "rank {c} failed")?,
            Some(c) => write!(f, "rank {} reported a failure of rank {c}", self.reporter)?,
            None => write!(f, "rank {} reported", self.reporter)?,
        }
        if let Some((op, seq)) = self.collective {
            write!(f, " during {op} {seq}")?;
        }
        write!(f, ": {}", self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_culprit_and_collective() {
        let r = AbortRecord {
            reporter: Rank(1),
            culprit: Some(Rank(2)),
            collective: Some((CollectiveOp::Broadcast, CollectiveSeq(3))),
            reason: "x".into(),
        };
        assert_eq!(
            r.to_string(),
            "rank 1 reported a failure of rank 2 during broadcast #3: x"
        );
    }

    #[test]
    fn round_trip() {
        let r = AbortRecord {
            reporter: Rank(0),
            culprit: None,
            collective: None,
            reason: "why".into(),
        };
        let mut w = Writer::new();
        r.encode(&mut w);
        let bytes = w.finish();
        let mut rd = Reader::new(&bytes);
        assert_eq!(AbortRecord::decode(&mut rd).unwrap(), r);
        rd.finish().unwrap();
    }
}
