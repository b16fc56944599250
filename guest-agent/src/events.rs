//! Guest events for the trace pipeline (`events=N`): one event per handled message.
//!
//! The agent binary wraps its link in [`FramePerPoll`], so every `Agent::poll` handles at most
//! one received frame, and calls [`MessageEvents::after_poll`] after each poll. A poll that
//! handled a message (its reply already sent) records one event through
//! `Agent::record_event`, stamped with the guest TSC right then, whose id is the number of
//! messages handled so far. Event `k` therefore lies between the reply to message `k` and the
//! agent's read of message `k + 1`, a bracket the host can check exactly.
//!
//! Without [`FramePerPoll`] a poll drains everything received, and on a fast host the next
//! request often arrives before the poll returns: several messages would share one event.

use vmtsync_core::agent::{Agent, AgentClock, Link, LinkError};
use vmtsync_core::proto::Transport;

/// A [`Link`] that ends each poll's input at the first frame delimiter (`0x00`): after it,
/// `recv` returns 0 until [`FramePerPoll::rearm`]. Bytes after the delimiter stay in the
/// inner link (it is read one byte at a time), so nothing is lost.
#[derive(Debug)]
pub struct FramePerPoll<L> {
    inner: L,
    frame_done: bool,
}

impl<L> FramePerPoll<L> {
    /// Wraps `inner`, ready to deliver one frame.
    pub const fn new(inner: L) -> Self {
        Self {
            inner,
            frame_done: false,
        }
    }

    /// Lets the next poll receive the next frame.
    pub fn rearm(&mut self) {
        self.frame_done = false;
    }

    /// The wrapped link.
    pub const fn inner(&self) -> &L {
        &self.inner
    }
}

impl<L: Link> Link for FramePerPoll<L> {
    #[inline]
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        self.inner.send(frame)
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut n = 0;
        for slot in buf.iter_mut() {
            if self.frame_done {
                break;
            }
            let mut b = [0u8; 1];
            if self.inner.recv(&mut b)? == 0 {
                break;
            }
            *slot = b[0];
            n += 1;
            self.frame_done = b[0] == 0;
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        self.inner.transport()
    }
}

/// Records up to a budget of events, one per poll that handled a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageEvents {
    budget: u32,
    recorded: u32,
    handled: u32,
}

impl MessageEvents {
    /// At most `budget` events (0: none).
    pub const fn new(budget: u32) -> Self {
        Self {
            budget,
            recorded: 0,
            handled: 0,
        }
    }

    /// Call after every `agent.poll()`: records one event if the poll handled messages and
    /// the budget allows. An event the agent's full queue refuses still counts against the
    /// budget (the agent counts it as dropped and reports that in its batches).
    pub fn after_poll<L: Link, C: AgentClock, const E: usize>(
        &mut self,
        agent: &mut Agent<L, C, E>,
    ) {
        let now = agent.stats().messages_in;
        if now != self.handled && self.recorded < self.budget {
            agent.record_event(now);
            self.recorded += 1;
        }
        self.handled = now;
    }

    /// Events recorded (or dropped by a full queue) so far.
    pub const fn recorded(&self) -> u32 {
        self.recorded
    }
}

#[cfg(test)]
mod tests {
    use vmtsync_core::agent::fake::{FakeClock, FakeLink};
    use vmtsync_core::proto::{EventStamp, Features, Hello, Message, PROTOCOL_VERSION};

    use super::*;

    fn hello() -> Message {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            features: Features::NONE,
        })
    }

    /// Polls like the agent binary until the link has nothing left.
    fn run(agent: &mut Agent<FramePerPoll<FakeLink>, FakeClock>, ev: &mut MessageEvents) {
        while agent.link().inner().inbound_len() > 0 {
            agent.poll().expect("fake link works");
            ev.after_poll(agent);
            agent.link_mut().rearm();
        }
    }

    #[test]
    fn frames_arriving_together_get_one_event_each_in_order() {
        let mut link = FakeLink::new();
        assert!(link.push_message(&hello()));
        for seq in 0..4 {
            assert!(link.push_message(&Message::Probe { seq }));
        }
        let mut agent: Agent<_, _> =
            Agent::new(FramePerPoll::new(link), FakeClock::new(1000, 10, 0));
        let mut ev = MessageEvents::new(100);
        run(&mut agent, &mut ev);
        assert_eq!(ev.recorded(), 5);
        assert_eq!(agent.queued_events(), 5);
        assert!(
            agent
                .link_mut()
                .inner
                .push_message(&Message::EventsRequest { max: 8 })
        );
        agent.poll().expect("poll");
        // Drain the five replies, then read the batch.
        let mut batch = None;
        while let Some(m) = agent.link_mut().inner.next_sent() {
            if let Ok(Message::Events(b)) = m {
                batch = Some(b);
            }
        }
        let b = batch.expect("an event batch");
        let ids: Vec<u32> = b.events.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![1, 2, 3, 4, 5]);
        let tscs: Vec<u64> = b
            .events
            .iter()
            .map(|e| match e.stamp {
                EventStamp::Guest(t) => t.0,
                EventStamp::Host(h) => panic!("no mapping pushed, got host stamp {h:?}"),
            })
            .collect();
        assert!(tscs.windows(2).all(|w| w[0] < w[1]), "{tscs:?}");
    }

    #[test]
    fn the_budget_caps_events_and_idle_polls_record_none() {
        let mut link = FakeLink::new();
        assert!(link.push_message(&hello()));
        assert!(link.push_message(&Message::Probe { seq: 1 }));
        assert!(link.push_message(&Message::Probe { seq: 2 }));
        let mut agent: Agent<_, _> = Agent::new(FramePerPoll::new(link), FakeClock::new(0, 1, 0));
        let mut ev = MessageEvents::new(2);
        run(&mut agent, &mut ev);
        for _ in 0..3 {
            agent.poll().expect("idle poll");
            ev.after_poll(&mut agent);
        }
        assert_eq!((ev.recorded(), agent.queued_events()), (2, 2));
        assert_eq!(agent.stats().messages_in, 3);
    }

    #[test]
    fn recv_stops_after_the_delimiter_until_rearmed() {
        let mut link = FakeLink::new();
        assert!(link.push_inbound(&[1, 2, 0, 3, 0]));
        let mut l = FramePerPoll::new(link);
        let mut buf = [0u8; 8];
        assert_eq!(l.recv(&mut buf), Ok(3));
        assert_eq!(&buf[..3], &[1, 2, 0]);
        assert_eq!(l.recv(&mut buf), Ok(0));
        l.rearm();
        assert_eq!(l.recv(&mut buf), Ok(2));
        assert_eq!(&buf[..2], &[3, 0]);
        l.rearm();
        assert_eq!(l.recv(&mut buf), Ok(0));
        assert_eq!(l.transport(), Transport::Memory);
    }
}
