/*
 * evzmq: a ZeroMQ socket inside a libevent loop. The only code that reads ZMQ_FD.
 *
 * ZMQ_FD is edge-triggered: it signals "something changed", not "a message is pending",
 * and both sends and receives consume the notification. So the watcher never trusts the
 * fd alone: on every wake-up it reads ZMQ_EVENTS and calls the user's callback while
 * ZMQ_POLLIN is set, at most max_per_cb times (fairness with other events), and
 * re-activates itself when input is still pending. Code that sends on the socket from
 * outside the callback calls evzmq_after_send() so that input which arrived meanwhile is
 * not left unseen. Everything runs on the loop thread; nothing here blocks.
 */
#ifndef TP_EVZMQ_H
#define TP_EVZMQ_H

struct event_base;

typedef struct evzmq evzmq_t;

/* Called on the loop thread while the socket has input (ZMQ_POLLIN). It should receive
 * one message with ZMQ_DONTWAIT (receiving none or several is tolerated). It may send on
 * the socket. It must not destroy the evzmq. */
typedef void (*evzmq_recv_cb)(void *sock, void *ud);

/* Watch `sock` (borrowed: the caller keeps ownership and closes it after
 * evzmq_destroy) on `base`. max_per_cb >= 1 caps callback calls per wake-up.
 * Returns NULL (errno set) if ZMQ_FD cannot be read or the event cannot be added. */
evzmq_t *evzmq_new(struct event_base *base, void *sock, int max_per_cb, evzmq_recv_cb cb, void *ud);

/* Stop watching and free. Takes NULL; sets *z to NULL. Does not close the socket. */
void evzmq_destroy(evzmq_t **z);

/* Tell the watcher the socket was used (send) outside its callback: re-reads ZMQ_EVENTS
 * and schedules the callback if input is pending. Never calls the callback directly. */
void evzmq_after_send(evzmq_t *z);

#endif
