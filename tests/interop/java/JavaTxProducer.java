import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.MetaMessageSessionFactory;
import com.taobao.metamorphosis.client.producer.MessageProducer;
import com.taobao.metamorphosis.client.producer.SendResult;

import java.nio.charset.StandardCharsets;

/**
 * Metaq 1.4 local transactions, as its TransactionProducer example uses them (there is no
 * separate "transactional producer": every MessageProducer has beginTransaction / commit /
 * rollback):
 *
 * <pre>JavaTxProducer &lt;zkConnect&gt; &lt;topic&gt; &lt;prefix&gt; [timeout=&lt;seconds&gt;] &lt;op&gt;...</pre>
 *
 * Each op is {@code commit:<n>} or {@code rollback:<n>}: one transaction
 * (beginTransaction, n sendMessage calls with bodies {@code <prefix>-<t>-<i>}, where t counts the
 * ops from 0, then commit() or rollback()).  Prints {@code BEGIN <t>}, one {@code SENT ...} line
 * per message, then {@code COMMITTED <t>} / {@code ROLLEDBACK <t>}.  With a {@code :wait} suffix
 * ({@code commit:<n>:wait}) it prints {@code AWAITING <t>} after the sends and reads one line from
 * stdin before committing or rolling back, so a test can look at the broker in between.  On the first exception it
 * prints {@code ERROR ...}, tries rollback() (printing {@code ROLLBACK-ERROR ...} if that fails
 * too), prints {@code DONE} and exits 1; otherwise {@code DONE} and exit 0.
 */
public class JavaTxProducer {
    public static void main(String[] args) throws Exception {
        String zkConnect = args[0];
        String topic = args[1];
        String prefix = args[2];
        int first = 3;
        int timeout = 0;
        if (args.length > first && args[first].startsWith("timeout=")) {
            timeout = Integer.parseInt(args[first].substring("timeout=".length()));
            first++;
        }
        MetaMessageSessionFactory factory = Interop.factory(zkConnect);
        int status = 0;
        try {
            MessageProducer producer = factory.createProducer();
            producer.publish(topic);
            if (timeout > 0) {
                producer.setTransactionTimeout(timeout);
            }
            for (int t = 0; first + t < args.length && status == 0; t++) {
                String[] op = args[first + t].split(":");
                int n = Integer.parseInt(op[1]);
                boolean inTx = false;
                try {
                    producer.beginTransaction();
                    inTx = true;
                    Interop.out("BEGIN " + t);
                    for (int i = 0; i < n; i++) {
                        Message m = new Message(topic, (prefix + "-" + t + "-" + i).getBytes(StandardCharsets.UTF_8));
                        SendResult r = producer.sendMessage(m);
                        Interop.sent(r, m);
                        if (!r.isSuccess()) {
                            throw new IllegalStateException("send failed: " + r.getErrorMessage());
                        }
                    }
                    if (op.length > 2 && op[2].equals("wait")) {
                        Interop.out("AWAITING " + t);
                        Interop.awaitInput();
                    }
                    if (op[0].equals("commit")) {
                        inTx = false;
                        producer.commit();
                        Interop.out("COMMITTED " + t);
                    } else if (op[0].equals("rollback")) {
                        inTx = false;
                        producer.rollback();
                        Interop.out("ROLLEDBACK " + t);
                    } else {
                        throw new IllegalArgumentException("unknown op " + args[first + t]);
                    }
                } catch (Throwable e) {
                    Interop.error(e);
                    status = 1;
                    if (inTx) {
                        try {
                            producer.rollback();
                        } catch (Throwable e2) {
                            Interop.out("ROLLBACK-" + errorLine(e2));
                        }
                    }
                }
            }
            producer.shutdown();
        } catch (Throwable t) {
            Interop.error(t);
            status = 1;
        } finally {
            Interop.out("DONE");
            factory.shutdown();
        }
        System.exit(status);
    }

    private static String errorLine(Throwable t) {
        return "ERROR " + t.getClass().getName() + ": " + Interop.oneLine(t.getMessage());
    }
}
