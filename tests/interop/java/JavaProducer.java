import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.MetaMessageSessionFactory;
import com.taobao.metamorphosis.client.producer.MessageProducer;
import com.taobao.metamorphosis.client.producer.SendResult;

import java.nio.charset.StandardCharsets;

/**
 * A plain Metaq 1.4 producer: {@code JavaProducer <zkConnect> <topic> <n> <prefix>} sends
 * bodies {@code <prefix>-0 .. <prefix>-(n-1)} one by one (synchronously, default round-robin
 * partition selector) and prints one {@code SENT <partition> <offset> <msgId> <body>} line per
 * message ({@code FAILED <body> <error>} when the broker refuses one), then {@code DONE}.
 * Exits 0 when every send succeeded, 1 otherwise.
 */
public class JavaProducer {
    public static void main(String[] args) throws Exception {
        String zkConnect = args[0];
        String topic = args[1];
        int n = Integer.parseInt(args[2]);
        String prefix = args[3];
        MetaMessageSessionFactory factory = Interop.factory(zkConnect);
        int failures = 0;
        try {
            MessageProducer producer = factory.createProducer();
            producer.publish(topic);
            for (int i = 0; i < n; i++) {
                Message m = new Message(topic, (prefix + "-" + i).getBytes(StandardCharsets.UTF_8));
                SendResult r = producer.sendMessage(m);
                Interop.sent(r, m);
                if (!r.isSuccess()) {
                    failures++;
                }
            }
            producer.shutdown();
            Interop.out("DONE");
        } catch (Throwable t) {
            Interop.error(t);
            failures++;
        } finally {
            factory.shutdown();
        }
        System.exit(failures == 0 ? 0 : 1);
    }
}
